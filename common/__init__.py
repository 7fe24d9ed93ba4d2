"""The ground floor every program of the project stands on (wheelbuilder, images, dflash): file-system
primitives, the one subprocess wrapper, the one command-line frame and the base of every error with an
exit code. It imports nothing else of the project."""

__version__ = "0.1.0"
