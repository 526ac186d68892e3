"""TensorRT build pieces: optimization profiles, trtexec command lines, the engine sidecar / integrity and portability
guard, and the engine build itself (``engine_build``). The version strategy and every other TensorRT fact live in
``qdeploy.facts.tensorrt``; its names are re-exported here for the builder's convenience."""
from qdeploy.facts.tensorrt import SUPPORTED_MAJORS, TrtPlan, TrtUnsupported, major_of, plan_build
from qdeploy.artifacts.tensorrt.profiles import InputProfile, check_profile, derive_profile, explicit_profiles
from qdeploy.artifacts.tensorrt.sidecar import (
    EngineNotPortable, engine_problem, portability_problem, read_sidecar, sidecar_path, write_sidecar,
)
from qdeploy.artifacts.tensorrt.trtexec import trtexec_command

__all__ = ["EngineNotPortable", "InputProfile", "SUPPORTED_MAJORS", "TrtPlan", "TrtUnsupported", "check_profile",
           "derive_profile", "engine_problem", "explicit_profiles", "major_of", "plan_build", "portability_problem",
           "read_sidecar", "sidecar_path", "trtexec_command", "write_sidecar"]
