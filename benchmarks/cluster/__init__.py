"""The emulated cluster: network namespaces with shaped links on one machine (``netns``), one process
per rank inside them (``launch``), TCP probes of the links (``linkprobe``), and the benchmark that runs
All-Reduce, DecentralizedAdam and decent-dp on it (``python -m benchmarks.cluster.run``; README.md)."""
