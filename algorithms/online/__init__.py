"""Online SAC and the dataset levels made with it (random, medium, expert, medium-replay)."""
