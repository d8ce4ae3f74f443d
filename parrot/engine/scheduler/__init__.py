"""Local (per-engine) iteration scheduling. No torch."""
