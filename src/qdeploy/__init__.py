"""qdeploy: compare a trained vision model across engines and precisions on real data."""
__version__ = "0.1.0"
