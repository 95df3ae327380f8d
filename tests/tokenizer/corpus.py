"""Deterministic conversations for the tokenizer's job tests and benchmark: thinking-mode, some
multi-turn, mixed English, code and CJK."""

from __future__ import annotations

import json
import random

WORDS = ("the model reads each token and predicts the next one while the drafter proposes a block "
         "of sixteen tokens that the target verifies in one forward pass so acceptance length matters").split()
CJK = "我们需要先理解问题然后逐步推理最后给出答案这个函数的时间复杂度是多少请解释一下"
CODE = ["def f(x):\n    return x * 2\n", "for i in range(10):\n    print(i)\n", "import numpy as np\na = np.zeros(3)\n",
        "class Node:\n    def __init__(self, v):\n        self.v = v\n", "SELECT id, name FROM users WHERE id = 1;\n"]


def _prose(rng: random.Random, n: int) -> str:
    out = []
    for _ in range(n):
        r = rng.random()
        if r < 0.12:
            out.append(CJK[rng.randrange(0, len(CJK) - 8):][: rng.randint(4, 16)])
        elif r < 0.2:
            out.append("\n```python\n" + rng.choice(CODE) + "```\n")
        else:
            out.append(rng.choice(WORDS))
    return " ".join(out)


def conversation(rng: random.Random, scale: int = 1) -> list[dict]:
    msgs = []
    if rng.random() < 0.3:
        msgs.append({"role": "system", "content": "You are a helpful assistant. " + _prose(rng, 8)})
    for _ in range(1 if rng.random() < 0.7 else rng.randint(2, 3)):
        msgs.append({"role": "user", "content": _prose(rng, rng.randint(8, 40) * scale)})
        msgs.append({"role": "assistant", "content": _prose(rng, rng.randint(20, 120) * scale),
                     "reasoning_content": _prose(rng, rng.randint(30, 200) * scale)})
    return msgs


def records(n: int, seed: int = 0, prefix: str = "s", scale: int = 1) -> list[dict]:
    rng = random.Random(seed)
    return [{"id": f"{prefix}{i:06d}", "messages": conversation(rng, scale),
             "meta": {"model": "tiny", "finish_reason": "stop"}} for i in range(n)]


def jsonl(recs: list[dict]) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs).encode()
