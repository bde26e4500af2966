"""Run by the llama-cpp-python venv's interpreter (no pipeserve there): reads a JSON job
from argv[1], writes llama.cpp's answers as JSON to argv[2].

job: {"gguf": path, "prompts": [text...], "tokens": N, "corpus": [text...]}
out: {"prompts": [{"ids", "greedy", "top": [[id, logit]...] first step,
                   "steps": [[[id, logit] x 2] per greedy step]}],
      "corpus": [ids...], "corpus_bos": [ids...]}
"""

import json
import sys

import numpy as np
from llama_cpp import Llama


def top(logits, k):
    order = np.argsort(-logits)[:k]
    return [[int(i), float(logits[i])] for i in order]


def main():
    job = json.load(open(sys.argv[1]))
    llm = Llama(
        job["gguf"],
        n_ctx=1024,
        n_threads=2,
        n_threads_batch=2,
        n_batch=512,
        logits_all=True,
        verbose=False,
    )
    prompts = []
    for text in job["prompts"]:
        llm.reset()
        ids = llm.tokenize(text.encode(), add_bos=True, special=True)
        llm.eval(ids)
        first = np.array(llm.scores[llm.n_tokens - 1])
        greedy, steps = [], []
        for _ in range(job["tokens"]):
            logits = np.array(llm.scores[llm.n_tokens - 1])
            token = int(np.argmax(logits))
            greedy.append(token)
            steps.append(top(logits, 2))
            llm.eval([token])
        prompts.append({"ids": ids, "greedy": greedy, "top": top(first, 5), "steps": steps})
    corpus = [llm.tokenize(t.encode(), add_bos=False, special=True) for t in job["corpus"]]
    bos = [llm.tokenize(t.encode(), add_bos=True, special=False) for t in job["corpus"]]
    json.dump({"prompts": prompts, "corpus": corpus, "corpus_bos": bos}, open(sys.argv[2], "w"))


main()
