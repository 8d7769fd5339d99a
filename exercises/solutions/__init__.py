"""Reference solutions: `python -m exercises --reference` grades these with the same graders."""
