# Sourced by bench/device/stage_zoo_device.sh and bench/device/stage_cpu_device.sh: trim_site DIR drops from an unpacked site what
# qdeploy's OpenVINO engine never loads: OpenVINO's GPU/NPU/AUTO/HETERO/auto-batch plugins, the frontends it does not
# convert from (TensorFlow, TF Lite, Paddle, JAX, GGUF), the C API, headers, benchmark_app (openvino/tools/benchmark),
# the GPU kernel cache and the licence texts' third-party folder. Kept: the CPU plugin, the ONNX, IR and PyTorch
# frontends (export/openvino_ir.py converts the FP32 ONNX, and the PyTorch module where that route is faster),
# openvino/tools/ovc (openvino.convert_model lives there: without it `ov.convert_model` is missing and every IR build
# fails), TBB/hwloc, the Python bindings. Then every __pycache__ and .pyi. A site without openvino loses only the latter two.
trim_site() {
  local S=$1 L=$1/openvino/libs
  rm -f $L/libopenvino_intel_gpu_plugin.so $L/libopenvino_intel_npu_plugin.so $L/libopenvino_auto_batch_plugin.so \
        $L/libopenvino_auto_plugin.so $L/libopenvino_hetero_plugin.so $L/cache.json $L/libopenvino_c.so.* $L/tbb.pc \
        $L/libopenvino_{tensorflow,tensorflow_lite,paddle,jax,gguf}_frontend.so.*
  rm -rf $S/openvino/include $S/openvino/tools/benchmark $S/openvino/frontend/{tensorflow,paddle,jax} \
         $S/openvino-*.dist-info/licenses/licensing
  find "$S" -name '__pycache__' -prune -exec rm -rf {} + ; find "$S" -name '*.pyi' -delete
}
