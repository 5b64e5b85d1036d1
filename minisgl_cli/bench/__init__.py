"""`minisgl bench`: workloads, runners (engine, HTTP server, HF and llama.cpp baselines), metrics, report."""
