"""The drafter on disk: the reference DFlash layout that serving engines read (`drafter`), and the
conversion of this project's older layout (`legacy`, `dflash export`)."""
