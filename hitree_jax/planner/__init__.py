"""The planner: cost and acceptance profiles, a latency model, and the search for the fastest stack."""
