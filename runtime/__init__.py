"""colibri runtime: model math, expert tiers, scheduling, sampling (numbers in memory)."""
