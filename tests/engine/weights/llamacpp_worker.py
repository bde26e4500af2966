"""Run by the llama-cpp-python venv's interpreter (no pipeserve there): reads a JSON job
from argv[1], writes llama.cpp's answers as JSON to argv[2]. The job's `command` says
what to do (default "generate").

generate: {"gguf": path, "prompts": [text...], "tokens": N, "corpus": [text...]}
  out: {"prompts": [{"ids", "greedy", "top": [[id, logit]...] first step,
                     "steps": [[[id, logit] x 2] per greedy step]}],
        "corpus": [ids...], "corpus_bos": [ids...]}
embed: {"gguf": path, "texts": [text...], "poolings": ["mean", "last"...]}
  out: {"ids": [ids per text], "<pooling>": {"raw": [vector...], "normalized": [...]}}
  (llama.cpp's embedding mode: Llama(embedding=True, pooling_type=...).embed())
fim: {"gguf": path, "cases": [{"prefix", "suffix", "prompt", "extra": [[name, text]...]}],
      "tokens": N, "n_ctx": C, "n_batch": B}
  out: {"fim": {"pre", "suf", "mid", "rep", "sep", "pad"} (ids, -1: none),
        "cases": [{"plain": ids, "infill": ids, "greedy_plain": {...}, "greedy_infill":
                   {...}}]} with greedy: {"greedy", "steps", "eog": [bool per token],
                   "texts": the first n tokens detokenized, n = 0..N (control
                   tokens as "", as llama.cpp's server without --special), "spelled": the
                   same with control tokens spelled out,
                   "top5": the 5 largest log-probabilities per step}
  plain: [BOS] PRE prefix SUF suffix MID; infill: the server's format_infill
  (tools/server/utils.hpp) for n_ctx C, n_batch B, n_predict -1.
"""

import json
import sys

import llama_cpp
import numpy as np
from llama_cpp import Llama


def top(logits, k):
    order = np.argsort(-logits)[:k]
    return [[int(i), float(logits[i])] for i in order]


def generating(gguf):
    return Llama(
        gguf,
        n_ctx=1024,
        n_threads=2,
        n_threads_batch=2,
        n_batch=512,
        logits_all=True,
        verbose=False,
    )


def greedy(llm, ids, tokens):
    """llama.cpp's greedy continuation of `ids`: tokens, top-2 logits per step, EOG flags."""
    llm.reset()
    llm.eval(ids)
    vocab = llm._model.vocab
    out, steps, eog, top5 = [], [], [], []
    for _ in range(tokens):
        logits = np.array(llm.scores[llm.n_tokens - 1])
        token = int(np.argmax(logits))
        out.append(token)
        steps.append(top(logits, 2))
        shifted = logits - logits.max()
        logprobs = shifted - np.log(np.exp(shifted).sum())
        top5.append([value for _, value in top(logprobs, 5)])
        eog.append(bool(llama_cpp.llama_vocab_is_eog(vocab, token)))
        llm.eval([token])
    texts = [llm.detokenize(out[:n]).decode("utf-8", errors="replace") for n in range(tokens + 1)]
    spelled = [
        llm.detokenize(out[:n], special=True).decode("utf-8", errors="replace")
        for n in range(tokens + 1)
    ]
    return {
        "greedy": out,
        "steps": steps,
        "eog": eog,
        "texts": texts,
        "spelled": spelled,
        "top5": top5,
    }


def generate(job):
    llm = generating(job["gguf"])
    prompts = []
    for text in job["prompts"]:
        ids = llm.tokenize(text.encode(), add_bos=True, special=True)
        llm.reset()
        llm.eval(ids)
        first = np.array(llm.scores[llm.n_tokens - 1])
        answer = greedy(llm, ids, job["tokens"])
        prompts.append(
            {"ids": ids, "greedy": answer["greedy"], "top": top(first, 5), "steps": answer["steps"]}
        )
    corpus = [llm.tokenize(t.encode(), add_bos=False, special=True) for t in job["corpus"]]
    bos = [llm.tokenize(t.encode(), add_bos=True, special=False) for t in job["corpus"]]
    return {"prompts": prompts, "corpus": corpus, "corpus_bos": bos}


POOLINGS = {
    "mean": llama_cpp.LLAMA_POOLING_TYPE_MEAN,
    "last": llama_cpp.LLAMA_POOLING_TYPE_LAST,
    "cls": llama_cpp.LLAMA_POOLING_TYPE_CLS,
}


def embed(job):
    texts = job["texts"]
    out = {}
    for name in job["poolings"]:
        llm = Llama(
            job["gguf"],
            embedding=True,
            pooling_type=POOLINGS[name],
            n_ctx=512,
            n_batch=512,
            n_threads=2,
            n_threads_batch=2,
            verbose=False,
        )
        out["ids"] = [llm.tokenize(t.encode()) for t in texts]  # as embed() tokenizes
        raw = [llm.embed(t, normalize=False) for t in texts]
        unit = [llm.embed(t, normalize=True) for t in texts]
        out[name] = {"raw": raw, "normalized": unit}
        llm.close()
    return out


def fim_ids(llm):
    vocab = llm._model.vocab
    names = {
        "pre": llama_cpp.llama_vocab_fim_pre,
        "suf": llama_cpp.llama_vocab_fim_suf,
        "mid": llama_cpp.llama_vocab_fim_mid,
        "rep": llama_cpp.llama_vocab_fim_rep,
        "sep": llama_cpp.llama_vocab_fim_sep,
        "pad": llama_cpp.llama_vocab_fim_pad,
    }
    return {key: int(get(vocab)) for key, get in names.items()}


def format_infill(llm, fim, case, n_ctx, n_batch, n_predict=-1):
    """llama.cpp's server format_infill (tools/server/utils.hpp), transcribed."""

    def tok(text, special=False):
        return llm.tokenize(text.encode(), add_bos=False, special=special) if text else []

    prefix, suffix, prompt = tok(case["prefix"]), tok(case["suffix"]), tok(case["prompt"], True)
    extra = []
    if fim["rep"] >= 0:
        extra += [fim["rep"], *tok("myproject\n")]
    for filename, text in case["extra"]:
        if fim["sep"] >= 0:
            extra += [fim["sep"], *tok(filename + "\n")]
        else:
            extra += tok("\n\n--- snippet ---\n\n")
        extra += tok(text)
    if fim["sep"] >= 0:
        extra += [fim["sep"], *tok("filename\n")]
    n_prefix = min(len(prefix), 3 * (n_batch // 4))
    n_suffix = min(len(suffix), max(0, n_batch // 4 - (2 + len(prompt))))
    n_extra = min(max(0, n_ctx - n_batch - 2 * n_predict), len(extra))
    prefix = [fim["pre"], *prefix[len(prefix) - n_prefix :], *prompt]
    suffix = [fim["suf"], *suffix[:n_suffix]]
    bos = [llm.token_bos()] if llama_cpp.llama_vocab_get_add_bos(llm._model.vocab) else []
    return extra[len(extra) - n_extra :] + bos + prefix + suffix + [fim["mid"]]


def plain_fim(llm, fim, case):
    """[BOS] PRE prefix SUF suffix MID: format_infill without the repository context."""
    return format_infill(
        llm, {**fim, "rep": -1, "sep": -1}, {**case, "prompt": "", "extra": []}, 0, 2048
    )


def fim(job):
    llm = generating(job["gguf"])
    ids = fim_ids(llm)
    cases = []
    for case in job["cases"]:
        plain = plain_fim(llm, ids, case)
        infill = format_infill(llm, ids, case, job["n_ctx"], job["n_batch"])
        cases.append(
            {
                "plain": plain,
                "infill": infill,
                "greedy_plain": greedy(llm, plain, job["tokens"]),
                "greedy_infill": greedy(llm, infill, job["tokens"]),
            }
        )
    return {"fim": ids, "cases": cases}


def main():
    job = json.load(open(sys.argv[1]))
    command = {"generate": generate, "embed": embed, "fim": fim}[job.get("command", "generate")]
    json.dump(command(job), open(sys.argv[2], "w"))


main()
