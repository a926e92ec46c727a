"""Analysis shared by every stage: the joint graph's regions, symbolic sizes, liveness."""
