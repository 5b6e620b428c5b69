"""The planner's data files (models.json, systems.json), read with importlib.resources."""
