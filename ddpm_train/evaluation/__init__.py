"""Evaluation: sampling with guidance, FID/KID, the copy check and the built-in shapes' score."""
