"""Where an INT8 Q/DQ ONNX (ONNX Runtime placement) loses accuracy against its FP32 ONNX, layer by layer (issue 34, item 3).

    python bench/diagnose/ort_gap.py layers FP32.onnx INT8.onnx --images 200 --out runs/ort_gap/NAME.json
    python bench/diagnose/ort_gap.py ablate bench/configs/heldout_tv_swin.yaml --out runs/ort_gap/abl_tv_swin \
        --set MatMul --set Add --set @softmax_adds --onnx runs/heldout_tv_swin/model.onnx
    # a set: comma-separated op types, re:REGEX on node names, @softmax_adds (the Adds feeding a Softmax)
    # @bias_adds (constant Adds after a weight MatMul: a Linear's bias)
    # or @residual_adds (float Adds of two activations not feeding a Softmax)

layers: both files run in ONNX Runtime with graph optimizations off (the Q/DQ file then computes exactly
DQ(Q(x)) in float, its "fake-quant" meaning; no QLinear fusion), every float tensor made a graph output, on the same
images (CIFAR-10 test, N spread over the classes, RGB/255 + ImageNet mean/std). It reports
  - per tensor present in both graphs (matched by name: ONNX Runtime's and qdeploy's Q/DQ keep the producer's tensor
    name and feed consumers a *_DequantizeLinear_Output): SQNR in dB of the INT8 graph's value against FP32's
    (accumulated error) and the producer's op type; "drop" = SQNR of the node's worst activation input (as it reaches
    the node, after its DQ) minus SQNR of its output: the error the node itself adds;
  - per quantizer (Q -> DQ): its own noise, SQNR of DQ(Q(x)) against x on the INT8 graph's values, the clipped share,
    scale / zero point, and the op types that consume it.
eval: top-1 / agreement of FP32 and INT8 files in ONNX Runtime (default optimizations) on up to the full test set:
    python bench/diagnose/ort_gap.py eval FP32.onnx INT8.onnx ... --images 10000 --out runs/ort_gap/full_NAME.json
ablate: the config's ONNX Runtime INT8 variant (method mean-minmax) again with each set of op types (or node-name
regexes, prefix re:) kept float (Int8Config.exclude_ops / exclude), top-1 and agreement with FP32 on the config's
eval images. Runs through qdeploy.api.run.
"""
from __future__ import annotations

import argparse
import copy
import glob
import json
import os
import re
from pathlib import Path

import numpy as np

MEAN, STD = np.array([0.485, 0.456, 0.406], np.float32), np.array([0.229, 0.224, 0.225], np.float32)
CIFAR_TEST = Path(__file__).resolve().parents[3] / "shared" / "data" / "cifar10" / "test"


def images(n: int, root: Path = CIFAR_TEST, size: int = 32) -> np.ndarray:
    from PIL import Image
    classes = sorted(os.listdir(root))
    per = -(-n // len(classes))
    files = [f for c in classes for f in sorted(glob.glob(str(root / c / "*.png")))[:per]][:n]
    xs = []
    for f in files:
        im = Image.open(f).convert("RGB")
        if size != 32:
            im = im.resize((size, size), Image.BILINEAR)
        xs.append((np.asarray(im, np.float32) / 255 - MEAN) / STD)
    return np.stack(xs).transpose(0, 3, 1, 2).copy()


def _float_tensors(model):
    import onnx
    m = onnx.shape_inference.infer_shapes(model)
    types = {v.name: v.type.tensor_type.elem_type for v in list(m.graph.value_info) + list(m.graph.output)}
    return types


def _expose_all(path: str):
    """The model with every float node output also a graph output."""
    import onnx
    from onnx import TensorProto, helper
    model = onnx.load(path)
    types = _float_tensors(model)
    have = {o.name for o in model.graph.output}
    for node in model.graph.node:
        for t in node.output:
            if t and t not in have and types.get(t) == TensorProto.FLOAT:
                model.graph.output.append(helper.make_tensor_value_info(t, TensorProto.FLOAT, None)); have.add(t)
    return model


def _run(model, x: np.ndarray, batch: int = 50) -> dict[str, np.ndarray]:
    import onnxruntime as ort
    so = ort.SessionOptions(); so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.intra_op_num_threads = 2
    s = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    name = s.get_inputs()[0].name
    names = [o.name for o in s.get_outputs()]
    out: dict[str, list] = {n: [] for n in names}
    for i in range(0, len(x), batch):
        for n, v in zip(names, s.run(names, {name: x[i:i + batch]})):
            out[n].append(v)
    return {n: np.concatenate(v) if v[0].ndim else np.stack(v) for n, v in out.items()}


def sqnr(ref: np.ndarray, x: np.ndarray) -> float:
    ref = ref.astype(np.float64); err = ((x.astype(np.float64) - ref) ** 2).sum()
    sig = (ref ** 2).sum()
    if err == 0:
        return float("inf")
    return float(10 * np.log10(max(sig, 1e-30) / err))


def layers(fp32: str, int8: str, n: int, size: int = 32) -> dict:
    import onnx
    x = images(n, size=size)
    mf, mq = _expose_all(fp32), _expose_all(int8)
    rf, rq = _run(mf, x), _run(mq, x)
    logits_f, logits_q = rf[mf.graph.output[0].name], rq[mq.graph.output[0].name]
    producer_q = {t: nd for nd in mq.graph.node for t in nd.output}
    consumers_q: dict[str, list] = {}
    for nd in mq.graph.node:
        for t in nd.input:
            consumers_q.setdefault(t, []).append(nd)
    inits_q = {i.name: onnx.numpy_helper.to_array(i) for i in mq.graph.initializer}
    for nd in mq.graph.node:  # Constant nodes hold scales/zero points too
        if nd.op_type == "Constant":
            inits_q[nd.output[0]] = onnx.numpy_helper.to_array(nd.attribute[0].t)

    def origin(t: str) -> str:
        """A DQ output traced back through DQ <- Q to the tensor the Q quantizes (the FP32 graph's name)."""
        p = producer_q.get(t)
        if p is not None and p.op_type == "DequantizeLinear":
            q = producer_q.get(p.input[0])
            if q is not None and q.op_type == "QuantizeLinear":
                return q.input[0]
        return t

    fnodes = {t: nd for nd in mf.graph.node for t in nd.output}
    tensor_rows = []
    acc = {}
    for nd in mq.graph.node:
        if nd.op_type in ("QuantizeLinear", "DequantizeLinear"):
            continue
        for t in nd.output:
            if t in rf and t in rq and rf[t].shape == rq[t].shape:
                acc[t] = sqnr(rf[t], rq[t])
    for nd in mq.graph.node:
        if nd.op_type in ("QuantizeLinear", "DequantizeLinear"):
            continue
        t = nd.output[0]
        if t not in acc:
            continue
        ins = []
        for i in nd.input:
            if not i or i in inits_q:
                continue
            o = origin(i)
            if o in inits_q:  # a quantized weight
                continue
            if i in rq and o in rf and rq[i].shape == rf[o].shape:
                ins.append(sqnr(rf[o], rq[i]))
        in_sq = min(ins) if ins else float("inf")
        int8_in = any(getattr(producer_q.get(i), "op_type", "") == "DequantizeLinear" for i in nd.input)
        tensor_rows.append({"tensor": t, "node": nd.name, "op": nd.op_type, "sqnr_db": round(acc[t], 2),
                            "input_sqnr_db": None if in_sq == float("inf") else round(in_sq, 2),
                            "drop_db": None if in_sq == float("inf") else round(in_sq - acc[t], 2),
                            "quantized_inputs": int8_in,
                            "fp32_absmax": float(np.abs(rf[t]).max())})
    q_rows = []
    for nd in mq.graph.node:
        if nd.op_type != "QuantizeLinear" or nd.input[0] in inits_q:
            continue
        src = nd.input[0]
        dqs = [c for c in consumers_q.get(nd.output[0], []) if c.op_type == "DequantizeLinear"]
        if not dqs or src not in rq or dqs[0].output[0] not in rq:
            continue
        xin, xdq = rq[src], rq[dqs[0].output[0]]
        scale = inits_q.get(nd.input[1]); zp = inits_q.get(nd.input[2]) if len(nd.input) > 2 else None
        users = sorted({c.op_type for d in dqs for c in consumers_q.get(d.output[0], [])})
        lo, hi = float(xdq.min()), float(xdq.max())
        clipped = float(((xin < lo - 1e-6) | (xin > hi + 1e-6)).mean())
        prod = fnodes.get(src)
        q_rows.append({"tensor": src, "producer": prod.op_type if prod is not None else "input",
                       "consumers": users, "own_sqnr_db": round(sqnr(xin, xdq), 2),
                       "fp32_sqnr_db": round(acc.get(src, sqnr(rf[src], rq[src]) if src in rf else float("nan")), 2),
                       "scale": None if scale is None else float(np.asarray(scale).ravel()[0]),
                       "zero_point": None if zp is None else int(np.asarray(zp).ravel()[0]),
                       "zp_dtype": None if zp is None else str(np.asarray(zp).dtype),
                       "range": [round(lo, 4), round(hi, 4)], "x_range": [float(xin.min()), float(xin.max())],
                       "x_p999_abs": float(np.quantile(np.abs(xin), 0.999)), "clipped": clipped})
    agree = float((logits_f.argmax(1) == logits_q.argmax(1)).mean())
    return {"fp32": fp32, "int8": int8, "images": n, "logits_sqnr_db": round(sqnr(logits_f, logits_q), 2),
            "argmax_agreement": agree,
            "op_counts_int8_graph": _counts(mq), "tensors": tensor_rows, "quantizers": q_rows}


def _counts(m) -> dict:
    c: dict[str, int] = {}
    for nd in m.graph.node:
        c[nd.op_type] = c.get(nd.op_type, 0) + 1
    return dict(sorted(c.items(), key=lambda kv: -kv[1]))


def print_layers(r: dict, k: int = 10) -> None:
    print(f"{r['int8']}\n  logits SQNR {r['logits_sqnr_db']} dB, argmax agreement {100 * r['argmax_agreement']:.1f} % "
          f"on {r['images']} images")
    rows = [t for t in r["tensors"] if t["drop_db"] is not None]
    print(f"  worst {k} nodes by the error they add (drop = worst input SQNR - output SQNR):")
    for t in sorted(rows, key=lambda t: -t["drop_db"])[:k]:
        print(f"    {t['op']:<22} drop {t['drop_db']:6.2f} dB  out {t['sqnr_db']:6.2f} dB  {t['tensor']}")
    print(f"  worst {k} tensors by accumulated SQNR (not counting the logits):")
    for t in sorted(r["tensors"], key=lambda t: t["sqnr_db"])[:k]:
        print(f"    {t['op']:<22} {t['sqnr_db']:6.2f} dB  {t['tensor']}")
    print(f"  noisiest {k} quantizers (own SQNR of DQ(Q(x)) vs x):")
    for q in sorted(r["quantizers"], key=lambda q: q["own_sqnr_db"])[:k]:
        print(f"    {q['producer']:>12} -> {'+'.join(q['consumers']):<24} own {q['own_sqnr_db']:6.2f} dB  "
              f"range {q['range']} x {[round(v, 3) for v in q['x_range']]} p99.9|x| {q['x_p999_abs']:.3g} "
              f"clip {100 * q['clipped']:.2f} %  {q['tensor']}")


def softmax_input_adds(onnx_path: str) -> list[str]:
    """Names of the Adds whose output reaches a Softmax through Reshape/Unsqueeze/Squeeze only (attention-score Adds:
    relative-position bias, shifted-window mask)."""
    import onnx
    m = onnx.load(onnx_path)
    prod = {t: n for n in m.graph.node for t in n.output}
    out = []
    for n in m.graph.node:
        if n.op_type != "Softmax":
            continue
        t = n.input[0]
        while (p := prod.get(t)) is not None:
            if p.op_type == "Add":
                out.append(p.name)
            elif p.op_type not in ("Reshape", "Unsqueeze", "Squeeze"):
                break
            t = p.input[0]
    return out


def bias_adds(onnx_path: str) -> list[str]:
    """Names of the Adds that add a constant (a Linear's bias) to a MatMul with a constant weight: how a Linear on a 3-D
    or 4-D tensor exports (MatMul + Add), where a 2-D one is one Gemm."""
    import onnx
    m = onnx.load(onnx_path)
    const = {i.name for i in m.graph.initializer} | {t for n in m.graph.node if n.op_type == "Constant" for t in n.output}
    prod = {t: n for n in m.graph.node for t in n.output}
    out = []
    for n in m.graph.node:
        if n.op_type != "Add" or len(n.input) != 2:
            continue
        c = [i in const for i in n.input]
        if sum(c) != 1:
            continue
        p = prod.get(n.input[c.index(False)])
        if p is not None and p.op_type == "MatMul" and any(i in const for i in p.input):
            out.append(n.name)
    return out


def residual_adds(onnx_path: str) -> list[str]:
    """Names of the float Adds of two activations that do not feed a Softmax: the residual (skip) Adds."""
    import onnx
    from onnx import TensorProto
    m = onnx.load(onnx_path)
    types = _float_tensors(m)
    const = {i.name for i in m.graph.initializer} | {t for n in m.graph.node if n.op_type == "Constant" for t in n.output}
    attn = set(softmax_input_adds(onnx_path))
    return [n.name for n in m.graph.node if n.op_type == "Add" and n.name not in attn and types.get(n.output[0]) == TensorProto.FLOAT
            and not any(i in const for i in n.input)]


SELECTORS = {"@softmax_adds": softmax_input_adds, "@bias_adds": bias_adds, "@residual_adds": residual_adds}


def ablate(config: str, sets: list[str], out: str, onnx_path: str | None = None) -> list[dict]:
    import yaml
    from qdeploy import api
    cfg_path = Path(config).resolve()
    cfg = yaml.safe_load(cfg_path.read_text())
    base = {"engine": "onnxruntime", "precision": "int8", "method": "mean-minmax", "placement": "onnxruntime"}
    variants = [{"engine": "onnxruntime", "precision": "fp32"}, dict(base)]
    for s in sets:
        v = dict(base)
        ops = [p for p in s.split(",") if p and not p.startswith("re:")]
        rx = [p[3:] for p in s.split(",") if p.startswith("re:")]
        for tok in [p for p in ops if p.startswith("@")]:  # a node class, resolved to node names on the FP32 ONNX
            ops.remove(tok)
            rx += ["^" + re.escape(n) + "$" for n in SELECTORS[tok](onnx_path)]
        if ops: v["exclude_ops"] = ops
        if rx: v["exclude"] = rx
        variants.append(v)
    cfg["variants"] = variants
    cfg.setdefault("bench", {})["enabled"] = False
    # relative paths in the config are relative to the config file: api.run takes a dict, so make them absolute
    def absol(p):
        return str((cfg_path.parent / p).resolve()) if not os.path.isabs(p) else p
    src = cfg["model"]["source"]
    if ":" in src and src.split(":", 1)[0].endswith(".py"):
        f, fn = src.rsplit(":", 1); cfg["model"]["source"] = f"{absol(f)}:{fn}"
    if cfg["model"].get("weights") not in (None, "random"):
        cfg["model"]["weights"] = absol(cfg["model"]["weights"])
    for k in ("eval", "calibration"):
        cfg["data"][k]["root"] = absol(cfg["data"][k]["root"])
    r = api.run(cfg, Path(out), cache_dir=Path(out).parent / "cache")
    rows = []
    for v in r["variants"]:
        top1 = v["metrics"].get("top1")
        rows.append({"variant": v["name"], "top1": None if top1 is None else round(100 * top1, 2),
                     "agreement": None if v.get("agreement") is None else round(100 * v["agreement"], 2),
                     "status": v["status"], "artifact": v.get("artifact") or v.get("artifacts")})
        print(f"  {v['name']:<60} top-1 {rows[-1]['top1']}  agreement {rows[-1]['agreement']}  {v['status']}")
    json.dump(rows, open(Path(out) / "ablation.json", "w"), indent=1)
    return rows


def evaluate(paths: list[str], n: int, size: int = 32) -> list[dict]:
    """Top-1 of each ONNX file (ONNX Runtime, default graph optimizations: the deployed kernels) on the first n/10
    test images of each class, and agreement with the first file (the FP32 reference); McNemar counts."""
    import onnxruntime as ort
    root = CIFAR_TEST
    classes = sorted(os.listdir(root)); per = -(-n // len(classes))
    y = np.array([i for i, c in enumerate(classes) for _ in sorted(glob.glob(str(root / c / "*.png")))[:per]][:n])
    x = images(n, size=size)
    preds = []
    for p in paths:
        so = ort.SessionOptions(); so.intra_op_num_threads = 2
        s = ort.InferenceSession(p, so, providers=["CPUExecutionProvider"])
        name = s.get_inputs()[0].name
        preds.append(np.concatenate([s.run(None, {name: x[i:i + 250]})[0].argmax(1) for i in range(0, len(x), 250)]))
    rows = []
    for p, pr in zip(paths, preds):
        ok, ok0 = pr == y, preds[0] == y
        rows.append({"file": p, "images": len(y), "top1": round(100 * ok.mean(), 2),
                     "delta": round(100 * (ok.mean() - ok0.mean()), 2), "agreement": round(100 * (pr == preds[0]).mean(), 2),
                     "only_fp32_right": int((ok0 & ~ok).sum()), "only_this_right": int((ok & ~ok0).sum())})
        print(f"  top-1 {rows[-1]['top1']:6.2f}  delta {rows[-1]['delta']:+.2f}  agreement {rows[-1]['agreement']:6.2f}  "
              f"fp32-only/this-only right {rows[-1]['only_fp32_right']}/{rows[-1]['only_this_right']}  {p}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("layers"); a.add_argument("fp32"); a.add_argument("int8")
    a.add_argument("--images", type=int, default=200); a.add_argument("--size", type=int, default=32)
    a.add_argument("--top", type=int, default=10); a.add_argument("--out")
    b = sub.add_parser("ablate"); b.add_argument("config"); b.add_argument("--set", action="append", default=[])
    b.add_argument("--out", required=True)
    b.add_argument("--onnx", help="the FP32 ONNX (for @softmax_adds: every Add feeding a Softmax)")
    e = sub.add_parser("eval"); e.add_argument("onnx", nargs="+"); e.add_argument("--images", type=int, default=10000)
    e.add_argument("--size", type=int, default=32); e.add_argument("--out")
    args = ap.parse_args()
    if args.cmd == "eval":
        rows = evaluate(args.onnx, args.images, args.size)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True); json.dump(rows, open(args.out, "w"), indent=1)
    elif args.cmd == "layers":
        r = layers(args.fp32, args.int8, args.images, args.size)
        print_layers(r, args.top)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            json.dump(r, open(args.out, "w"), indent=1)
    else:
        ablate(args.config, args.set, args.out, args.onnx)


if __name__ == "__main__":
    main()
