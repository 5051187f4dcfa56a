"""colibri runtime: model math, expert tiers, scheduling, sampling (numbers in memory).

Shape legend: each module states its own.
"""
