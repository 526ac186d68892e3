"""TensorRT build pieces that need no TensorRT: the version strategy, optimization profiles, trtexec command lines and
the engine sidecar / integrity and portability guard (issue #10, in progress: the engine build and runner come next)."""
from qdeploy.build.tensorrt.profiles import InputProfile, check_profile, derive_profile, explicit_profiles
from qdeploy.build.tensorrt.sidecar import (
    EngineNotPortable, engine_problem, portability_problem, read_sidecar, sidecar_path, write_sidecar,
)
from qdeploy.build.tensorrt.strategy import SUPPORTED_MAJORS, TrtPlan, TrtUnsupported, major_of, plan_build
from qdeploy.build.tensorrt.trtexec import trtexec_command

__all__ = ["EngineNotPortable", "InputProfile", "SUPPORTED_MAJORS", "TrtPlan", "TrtUnsupported", "check_profile",
           "derive_profile", "engine_problem", "explicit_profiles", "major_of", "plan_build", "portability_problem",
           "read_sidecar", "sidecar_path", "trtexec_command", "write_sidecar"]
