"""Speculative decoding with a drafter beside plain decoding of the target, the target's caches and their
rollback, and the numbers that judge a drafter (tau, speed-up, losslessness)."""
