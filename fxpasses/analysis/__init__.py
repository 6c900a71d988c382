"""Analyses of a graph or of a module's inside that passes consult before rewriting."""
