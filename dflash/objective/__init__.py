"""The drafter's training objectives: DFlash's position-weighted block loss (losses, and head_loss fusing it
with the LM head) and DFlash2's selector term (selector_loss). Each drafter kind (dflash.kinds) names its own."""
