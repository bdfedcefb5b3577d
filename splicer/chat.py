"""The built-in synthetic chat set: a fixed persona system prompt, a few turns of history and
generated user turns, rendered with the model's chat template (thinking off).

The assistant answers are not stored here: the base generates them greedily, and the
variants are scored on those answers (dNLL), as in seed 000's harness. Everything is
written for this tool; nothing is taken from a data set.
"""

from __future__ import annotations

import itertools

# Several personas and histories, so that conversations differ in more than their last turn: with one shared
# prefix, most chat positions were the same context again (see ablate.first_occurrence_weights).
PERSONAS = [
    (
        "You are Lin, the voice assistant of a small travel company. You speak Chinese and English, "
        "answer in one or two short spoken sentences, never use lists or markdown, and ask a short "
        "question back when the request is unclear. Keep prices in yuan and times in 24-hour format. "
        "你是林，一家小型旅行社的语音助手。回答要口语化，一两句话说完，不用列表。"
    ),
    (
        "You are Bao, the booking desk of a mountain guesthouse. Reply briefly and politely in the guest's "
        "language, confirm dates back, and never promise a room you have not checked. "
        "你是宝，山里一家民宿的前台。用客人的语言简短回答，先确认日期。"
    ),
    (
        "You are Mei, a phone assistant for a city museum. Answer in at most two sentences, give opening "
        "hours and ticket prices exactly, and suggest one exhibit when asked what to see. "
        "你是梅，市博物馆的电话助手，最多两句话，开放时间和票价要准确。"
    ),
]

HISTORIES = [
    [
        ("user", "你好，我想问一下周末去海边的行程。"),
        ("assistant", "好的，周六早上八点从火车站出发，中午到海边，周日下午回来。您想订几个人？"),
        ("user", "Two adults and one child, is there a discount for kids?"),
        ("assistant", "Yes, children under twelve pay half price, so the trip is 1,250 yuan in total."),
    ],
    [
        ("user", "Hi, do you have a double room free on the 14th and 15th?"),
        ("assistant", "Let me check: yes, one double room is free both nights, 380 yuan a night with breakfast."),
        ("user", "太好了，可以帮我留着吗？我们大概下午四点到。"),
        ("assistant", "可以，我先帮您保留到十四号下午六点，到时候前台等您。"),
    ],
    [
        ("user", "请问博物馆星期一开门吗？"),
        ("assistant", "星期一闭馆，星期二到星期日九点到十七点开放，十六点停止入场。"),
        ("user", "How much is a ticket for a student?"),
        ("assistant", "Students pay 20 yuan with a student card; the permanent galleries are free on Wednesdays."),
    ],
]
HISTORY = HISTORIES[0]

_ZH_ASK = ["那个{x}怎么安排？", "{x}需要提前订吗？", "请问{x}大概多少钱？", "我们能不能改一下{x}？", "{x}有没有别的选择？"]
_EN_ASK = ["What about the {x}?", "Can we change the {x}?", "How early should we book the {x}?", "Is the {x} included?"]
_ZH_X = ["酒店", "午饭", "回程的火车", "海边的船", "导游", "行李", "儿童座椅", "晚上的活动"]
_EN_X = ["hotel", "lunch", "return train", "boat trip", "guide", "luggage", "child seat", "evening plan"]


def user_turns(n: int) -> list[str]:
    """n deterministic user turns, alternating Chinese and English phrasings."""
    zh = (t.format(x=x) for t, x in itertools.product(_ZH_ASK, _ZH_X))
    en = (t.format(x=x) for t, x in itertools.product(_EN_ASK, _EN_X))
    out = []
    for a, b in itertools.zip_longest(zh, en):
        for t in (a, b):
            if t is not None and len(out) < n:
                out.append(t)
    if len(out) < n:
        raise ValueError(f"the built-in chat set has {len(out)} user turns; ask for at most that many")
    return out


def conversations(n: int, history_turns: int = 4) -> list[list[dict]]:
    """n conversations: persona and history change with every conversation (i % 3), the last user turn too."""
    out = []
    for i, u in enumerate(user_turns(n)):
        hist = [{"role": r, "content": c} for r, c in HISTORIES[i % len(HISTORIES)][:history_turns]]
        out.append([{"role": "system", "content": PERSONAS[i % len(PERSONAS)]}, *hist, {"role": "user", "content": u}])
    return out


def chat_training_text() -> str:
    return "\n".join([*PERSONAS, *(c for h in HISTORIES for _, c in h), *user_turns(60)])
