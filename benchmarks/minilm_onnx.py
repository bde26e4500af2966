"""all-MiniLM-L6-v2 as an ONNX graph built here from its safetensors (onnx.helper), for
onnxruntime as the peer in embed_bench.py: the same weights, tokens and pooling, so the
two engines are compared on one model. Inputs: input_ids [B, L] int64, attention_mask
[B, L] float32, position_ids [L] int64; output: mean-pooled vectors [B, H] (normalised
by the caller). Needs `pip install onnx onnxruntime` (not a pipeserve dependency)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load_file


class _Graph:
    def __init__(self) -> None:
        from onnx import helper

        self.helper = helper
        self.nodes: list[Any] = []
        self.inits: list[Any] = []
        self.count = 0

    def const(self, name: str, value: np.ndarray) -> str:
        from onnx import numpy_helper

        self.inits.append(numpy_helper.from_array(value, name))
        return name

    def op(self, kind: str, inputs: list[str], **attrs: Any) -> str:
        self.count += 1
        out = f"{kind.lower()}_{self.count}"
        self.nodes.append(self.helper.make_node(kind, inputs, [out], **attrs))
        return out


def build_minilm_onnx(folder: Path) -> bytes:
    """The serialized ONNX model of a BERT folder (sentence-transformers mean pooling)."""
    import onnx
    from onnx import TensorProto, helper

    w = load_file(str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    eps, size = config["layer_norm_eps"], hidden // config["num_attention_heads"]
    g = _Graph()

    def param(key: str, transpose: bool = False) -> str:
        value = w[key].astype(np.float32)
        return g.const(key, np.ascontiguousarray(value.T) if transpose else value)

    def dense(x: str, prefix: str) -> str:
        return g.op(
            "Add", [g.op("MatMul", [x, param(prefix + ".weight", True)]), param(prefix + ".bias")]
        )

    def norm(x: str, prefix: str) -> str:
        return g.op("LayerNormalization", [x, param(prefix + ".weight"), param(prefix + ".bias")],
                    axis=-1, epsilon=eps)  # fmt: skip

    words = g.op("Gather", [param("embeddings.word_embeddings.weight"), "input_ids"])
    positions = g.op("Gather", [param("embeddings.position_embeddings.weight"), "position_ids"])
    types = g.const("type0", w["embeddings.token_type_embeddings.weight"][0].astype(np.float32))
    h = norm(g.op("Add", [g.op("Add", [words, positions]), types]), "embeddings.LayerNorm")
    one, big = g.const("one", np.array(1.0, np.float32)), g.const("big", np.array(-1e9, np.float32))
    bias = g.op("Mul", [g.op("Sub", [one, "attention_mask"]), big])
    bias = g.op("Unsqueeze", [bias, g.const("axes12", np.array([1, 2], np.int64))])
    split = g.const("split_shape", np.array([0, 0, heads, size], np.int64))
    merge = g.const("merge_shape", np.array([0, 0, hidden], np.int64))
    scale = g.const("scale", np.array(1 / math.sqrt(size), np.float32))
    half, root2 = (
        g.const("half", np.array(0.5, np.float32)),
        g.const("root2", np.array(math.sqrt(2), np.float32)),
    )
    for i in range(config["num_hidden_layers"]):
        p = f"encoder.layer.{i}."
        q = g.op(
            "Transpose",
            [g.op("Reshape", [dense(h, p + "attention.self.query"), split])],
            perm=[0, 2, 1, 3],
        )
        k = g.op(
            "Transpose",
            [g.op("Reshape", [dense(h, p + "attention.self.key"), split])],
            perm=[0, 2, 3, 1],
        )
        v = g.op(
            "Transpose",
            [g.op("Reshape", [dense(h, p + "attention.self.value"), split])],
            perm=[0, 2, 1, 3],
        )
        scores = g.op("Add", [g.op("Mul", [g.op("MatMul", [q, k]), scale]), bias])
        context = g.op("MatMul", [g.op("Softmax", [scores], axis=-1), v])
        context = g.op("Reshape", [g.op("Transpose", [context], perm=[0, 2, 1, 3]), merge])
        h = norm(
            g.op("Add", [dense(context, p + "attention.output.dense"), h]),
            p + "attention.output.LayerNorm",
        )
        mid = dense(h, p + "intermediate.dense")
        gelu = g.op(
            "Mul",
            [
                g.op("Mul", [mid, half]),
                g.op("Add", [g.op("Erf", [g.op("Div", [mid, root2])]), one]),
            ],
        )
        h = norm(g.op("Add", [dense(gelu, p + "output.dense"), h]), p + "output.LayerNorm")
    weights = g.op("Unsqueeze", ["attention_mask", g.const("axis2", np.array([2], np.int64))])
    total = g.op(
        "ReduceSum",
        [g.op("Mul", [h, weights]), g.const("axis1", np.array([1], np.int64))],
        keepdims=0,
    )
    count = g.op(
        "ReduceSum", ["attention_mask", g.const("axis1b", np.array([1], np.int64))], keepdims=1
    )
    pooled = g.op("Div", [total, count])
    graph = helper.make_graph(
        g.nodes,
        "minilm",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["B", "L"]),
         helper.make_tensor_value_info("attention_mask", TensorProto.FLOAT, ["B", "L"]),
         helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["L"])],
        [helper.make_tensor_value_info(pooled, TensorProto.FLOAT, ["B", hidden])],
        g.inits,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    onnx.checker.check_model(model)
    return bytes(model.SerializeToString())


class OnnxEmbedder:
    """onnxruntime on the built graph; embed(list of token-id lists) -> [N, H] normalised."""

    def __init__(self, folder: Path, threads: int = 0) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        self.session = ort.InferenceSession(
            build_minilm_onnx(folder), options, providers=["CPUExecutionProvider"]
        )

    def embed(self, batch: list[list[int]]) -> np.ndarray:
        width = max(len(ids) for ids in batch)
        ids = np.zeros((len(batch), width), np.int64)
        mask = np.zeros((len(batch), width), np.float32)
        for row, seq in enumerate(batch):
            ids[row, : len(seq)], mask[row, : len(seq)] = seq, 1.0
        feeds = {
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": np.arange(width, dtype=np.int64),
        }
        (pooled,) = self.session.run(None, feeds)
        out: np.ndarray = pooled / np.linalg.norm(pooled, axis=1, keepdims=True)
        return out
