"""Lab code that launches or talks to real vLLM servers: observe, calibrate, fidelity, the parity harness."""
