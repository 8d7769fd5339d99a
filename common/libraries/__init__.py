"""What Accelerate and Lightning Fabric run for you, measured against the lessons (23)."""
