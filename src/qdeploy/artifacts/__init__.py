"""Build stage: typed artifacts (artifacts/types.py) made once per run and cached by fingerprint (artifacts/builder.py)."""
from qdeploy.artifacts.types import Artifact, ArtifactKind, ArtifactRequest
from qdeploy.artifacts.builder import Builder

__all__ = ["Artifact", "ArtifactKind", "ArtifactRequest", "Builder"]
