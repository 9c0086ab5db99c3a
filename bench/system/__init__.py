"""What the system around the step costs, measured on this machine with real processes and the local stand-ins:
launching on a local slice, recovering from preemptions, a second slice, preparing and loading data, profiling."""
