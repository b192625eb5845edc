"""The live controller: an OpenAI-compatible proxy in front of real vLLM workers that runs the same
`twin.policy` objects the simulator evaluates (docs/architecture.md)."""
