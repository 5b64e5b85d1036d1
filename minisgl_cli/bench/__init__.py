"""`minisgl bench`: workloads, targets (engine, HTTP server, HF and llama.cpp baselines), metrics, report."""
