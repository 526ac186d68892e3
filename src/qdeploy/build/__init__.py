"""Build stage: typed artifacts (build/artifacts.py) made once per run and cached by fingerprint (build/builder.py)."""
from qdeploy.build.artifacts import Artifact, ArtifactKind, ArtifactRequest
from qdeploy.build.builder import Builder

__all__ = ["Artifact", "ArtifactKind", "ArtifactRequest", "Builder"]
