"""What users do with runs: reports, comparisons, sweeps, planning, the roofline check."""
