"""What-if planner actions: precision schedules, partial KV loading, early exit, semantic batching.

Each is an explicit effect model (`twin.whatif.model` for the step-time ones, `twin.whatif.semantic` for the
queue order) whose effect sizes are ASSUMPTIONS the user sets; `twin.analysis.physics` bounds what any of them can reach.
Kept light: importing this package imports no simulator module.
"""
