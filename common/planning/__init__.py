"""Planning a run: a cost model of a training step and a planner over layouts (lesson 21)."""
