"""deepinfer_parallel: process groups, attention DP, CP, MoE EP, and EPLB (``.eplb``)."""
