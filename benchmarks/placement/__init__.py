"""The placement sweep: workloads, SLO cells and the rate search."""
