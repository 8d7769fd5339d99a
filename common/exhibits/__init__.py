"""Lesson 12's exhibits: reproduced failures, each with its symptom, diagnosis and fix."""
