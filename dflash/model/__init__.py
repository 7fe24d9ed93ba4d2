"""The models: the DFlash drafter and its attention mask, and the frozen target it drafts for."""
