"""The drafter's training objectives every kind shares: DFlash's position-weighted block loss (losses, and
head_loss fusing it with the LM head). Each drafter kind (dflash.kinds) names its own objective; a kind's own
terms live in its folder (DFlash2's selector term: dflash.kinds.dflash2.selector_loss)."""
