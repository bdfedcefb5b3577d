"""The built-in synthetic chat set: a persona system prompt, a few turns of history and a generated user turn,
rendered with the model's chat template (thinking off).

The assistant answers are not stored here: the base generates them greedily, and the
variants are scored on those answers (dNLL), as in seed 000's harness. Everything is
written for this tool; nothing is taken from a data set.

Conversations come in N_GROUPS groups, nested: a group is one business (the system prompt's role and rules) with its
own history, and conversation i is in group i % N_GROUPS (round-robin: 12 conversations are 12 groups of one, 72 are 12
groups of 6). Every conversation has its own assistant name (the system prompt's first word, each starting with its
own character, so that no two system prompts share their first token) and its own last user turn. Conversations of
one group share their business and history; conversations of different groups share no business and no history, only
the chat template's markup (its header `<|im_start|>system` and a newline, and the role markers), the few frame words
of the system prompt ("here: you are the") and the user-turn templates (_ZH_ASK x _ZH_X, _EN_ASK x _EN_X, shared by all
groups: short, and they let every conversation ask something different).

Conversations sharing a business or history share their effect (a variant that misreads a prefix misreads it in all
of them), so they are not independent evidence: the chat corpus records each sequence's group (corpora.Corpus.groups),
score files carry it per position, and every interval (metrics.summarize, metrics.paired_comparison, budget's
strata) resamples whole groups, counting groups where it counts units (docs/ablate.md). A prefix shared with an earlier conversation is the
same context again, which scores.first_occurrence_weights counts once.
"""

from __future__ import annotations

import itertools

# Names start with distinct characters: a byte-level tokenizer then starts every system prompt with its own token.
NAMES = [
    "Anna",
    "Bao",
    "Carmen",
    "Dmitri",
    "Elena",
    "Felix",
    "Grace",
    "Hiro",
    "Ines",
    "Jonas",
    "Kemal",
    "Lin",
    "Mei",
    "Nadia",
    "Oscar",
    "Priya",
    "Quinn",
    "Rosa",
    "Sami",
    "Tomas",
    "Uma",
    "Viktor",
    "Wen",
    "Ximena",
    "Yusuf",
    "Zora",
    "王芳",
    "李静",
    "张伟",
    "刘洋",
    "陈晨",
    "杨帆",
    "黄蕾",
    "赵磊",
    "吴敏",
    "周婷",
    "徐斌",
    "孙悦",
    "马骏",
    "朱琳",
    "胡杰",
    "郭蓉",
    "何平",
    "高远",
    "罗兰",
    "钟楠",
    "梁雪",
    "谢东",
    "宋雨",
    "唐宁",
    "韩梅",
    "冯涛",
    "邓佳",
    "曹阳",
    "彭程",
    "曾丽",
    "田野",
    "董飞",
    "袁媛",
    "潘峰",
    "蒋勇",
    "蔡琴",
    "于洋",
    "钱程",
    "叶青",
    "程亮",
    "苏珊",
    "魏来",
    "方舟",
    "丁香",
    "时雨",
    "车健",
]

# One group per business: (who the assistant is, its house rules, the earlier turns it had with a caller). Every
# business has its own history (nested, not crossed): conversations of one group share both, and no business or
# history appears in two groups. Every history has HISTORY_TURNS turns.
GROUPS = [
    (
        "the voice assistant of a small travel company",
        "Speak Chinese and English, answer in one or two short spoken sentences, never use lists or markdown, and ask a short "
        "question back when the request is unclear. Keep prices in yuan and times in 24-hour format. 回答要口语化，一两句话说完。",
        [
            ("user", "你好，我想问一下周末的安排。"),
            ("assistant", "好的，您是周六还是周日来？"),
            ("user", "Saturday, around ten in the morning."),
            ("assistant", "Saturday at ten works; how many people will come?"),
        ],
    ),
    (
        "the booking desk of a mountain guesthouse",
        "Reply briefly and politely in the guest's language, confirm dates back, and never promise a room you have not "
        "checked. 用客人的语言简短回答，先确认日期。",
        [
            ("user", "How do I get to you from the old town?"),
            ("assistant", "Take bus 12 to the last stop; we are two minutes' walk from there."),
            ("user", "有停车的地方吗？"),
            ("assistant", "门口有十个车位，停车免费。"),
        ],
    ),
    (
        "the phone assistant of a city museum",
        "Answer in at most two sentences, give opening hours and ticket prices exactly, and suggest one exhibit when asked "
        "what to see. 开放时间和票价要准确。",
        [
            ("user", "请问你们几点开门？"),
            ("assistant", "早上八点半开门，晚上六点关门。"),
            ("user", "And on public holidays?"),
            ("assistant", "On public holidays we open at ten and close at four."),
        ],
    ),
    (
        "the rental counter of a bicycle shop by the lake",
        "Quote hourly and daily prices, ask for a deposit of 200 yuan, and remind riders to bring the bike back before "
        "dusk. 自行车要在天黑前还回来。",
        [
            ("user", "Can I pay by card, or only cash?"),
            ("assistant", "Card, cash and mobile payment are all fine."),
            ("user", "那可以开发票吗？"),
            ("assistant", "可以，请把公司名称和税号发给我们。"),
        ],
    ),
    (
        "the receptionist of a dental clinic",
        "Book, move or cancel appointments, never give medical advice on the phone, and ask for the patient's name and "
        "phone number. 不在电话里给医疗建议。",
        [
            ("user", "我想取消明天的预约。"),
            ("assistant", "好的，明天下午三点的那个，对吗？"),
            ("user", "Yes, and can I move it to Friday instead?"),
            ("assistant", "Friday at three is free, so I have moved it there."),
        ],
    ),
    (
        "the information desk of a railway station",
        "Give departure times, platforms and fares from the timetable only, and say so when a train is delayed. "
        "只按时刻表回答，晚点要说明。",
        [
            ("user", "Do you speak English? My Chinese is not very good."),
            ("assistant", "Yes, we can talk in English, no problem."),
            ("user", "Thanks. My grandmother uses a wheelchair."),
            ("assistant", "There is a ramp at the side entrance and a lift inside."),
        ],
    ),
    (
        "the order line of a neighbourhood bakery",
        "Take cake orders at least one day ahead, repeat the order and the pick-up time back, and mention that "
        "nothing contains nuts unless asked for. 蛋糕要提前一天订。",
        [
            ("user", "我的名字是陈小红，上周订过一次。"),
            ("assistant", "陈女士您好，我查到了上周的订单。"),
            ("user", "Great, I'd like the same as last time."),
            ("assistant", "The same as last time, for which day?"),
        ],
    ),
    (
        "the ticket office of a river ferry company",
        "Sell tickets for the 08:00, 12:00 and 16:00 boats, say when a boat is full, and tell passengers to arrive fifteen "
        "minutes early. 请提前十五分钟到码头。",
        [
            ("user", "喂，你好，信号不太好。"),
            ("assistant", "您好，我听得到，请慢慢说。"),
            ("user", "We are a school group of thirty students."),
            ("assistant", "For groups of twenty or more there is a 20 % discount."),
        ],
    ),
    (
        "the ticket line of a city zoo",
        "Give ticket prices for adults, children and seniors, say which animals may be fed and when, and remind visitors "
        "that the last entry is at 16:30. 最后入园时间是下午四点半。",
        [
            ("user", "Hi, is anyone there? I called earlier and the line dropped."),
            ("assistant", "Yes, I'm here, sorry about that. What were you asking?"),
            ("user", "我们是两个大人一个小孩。"),
            ("assistant", "两个大人一个小孩，小孩半价。"),
        ],
    ),
    (
        "the help line of a language school",
        "Give course times and fees, offer one free trial lesson, and ask which level the learner has before suggesting a "
        "class. 先问学员的水平，再推荐课程。",
        [
            ("user", "我想给孩子报一个英语班。"),
            ("assistant", "好的，孩子今年几岁？"),
            ("user", "She is nine and has learned a little at school."),
            ("assistant", "Then the Saturday morning beginners' class suits her; the first lesson is free."),
        ],
    ),
    (
        "the reservation line of a hot-pot restaurant",
        "Take table bookings for up to twelve people, say how long the wait is at busy times, and note how spicy the "
        "guests want it. 记下客人要不要辣。",
        [
            ("user", "Can I book a table for tonight?"),
            ("assistant", "Yes, for how many people and at what time?"),
            ("user", "六个人，七点左右。"),
            ("assistant", "七点六位可以，要鸳鸯锅吗？"),
        ],
    ),
    (
        "the service desk of a car repair garage",
        "Book inspections and repairs, give a price only after a mechanic has looked at the car, and offer a courtesy car "
        "when one is free. 没看过车之前不报价。",
        [
            ("user", "我的车刹车有点响。"),
            ("assistant", "明白，您什么时候方便把车开过来？"),
            ("user", "Tomorrow morning before work, around eight?"),
            ("assistant", "Eight tomorrow is fine; checking takes about an hour."),
        ],
    ),
]
HISTORY_TURNS = 4
N_GROUPS = len(GROUPS)

_ZH_ASK = ["那个{x}怎么安排？", "{x}需要提前订吗？", "请问{x}大概多少钱？", "我们能不能改一下{x}？", "{x}有没有别的选择？"]
_EN_ASK = ["What about the {x}?", "Can we change the {x}?", "How early should we book the {x}?", "Is the {x} included?"]
_ZH_X = ["酒店", "午饭", "回程的火车", "海边的船", "导游", "行李", "儿童座椅", "晚上的活动"]
_EN_X = ["hotel", "lunch", "return train", "boat trip", "guide", "luggage", "child seat", "evening plan"]


# Every conversation has its own name and its own last user turn, so the set holds as many conversations as either.
MAX_CONVERSATIONS = min(len(NAMES), len(_ZH_ASK) * len(_ZH_X) + len(_EN_ASK) * len(_EN_X))


def user_turns(n: int) -> list[str]:
    """n deterministic user turns, alternating Chinese and English phrasings."""
    zh = (t.format(x=x) for t, x in itertools.product(_ZH_ASK, _ZH_X))
    en = (t.format(x=x) for t, x in itertools.product(_EN_ASK, _EN_X))
    out = []
    for a, b in itertools.zip_longest(zh, en):
        for t in (a, b):
            if t is not None and len(out) < n:
                out.append(t)
    if len(out) < n or n > MAX_CONVERSATIONS:
        raise ValueError(f"the built-in chat set has {min(len(out), MAX_CONVERSATIONS)} conversations; ask for at most that many")
    return out


def group(i: int) -> int:
    """Conversation i's group (round-robin: the first N_GROUPS conversations are each in a group of their own)."""
    return i % N_GROUPS


def persona(i: int) -> str:
    """Conversation i's system prompt: its own name first, then its group's role and rules."""
    role, rules, _ = GROUPS[group(i)]
    return f"{NAMES[i]} here: you are {role}. {rules}"


def conversations(n: int, history_turns: int = HISTORY_TURNS) -> list[list[dict]]:
    """n conversations, each with its own name and last user turn and its group's business and history (see the module
    docstring); conversation i is in group(i)."""
    out = []
    for i, u in enumerate(user_turns(n)):
        history = GROUPS[group(i)][2][:history_turns]
        out.append(
            [
                {"role": "system", "content": persona(i)},
                *({"role": r, "content": c} for r, c in history),
                {"role": "user", "content": u},
            ]
        )
    return out


def chat_training_text() -> str:
    """The chat set's text for the demo tokenizer. The names appear once more on their own, so that a small BPE
    vocabulary still merges each name's first character into a token of its own (see NAMES)."""
    return "\n".join(
        [*(persona(i) for i in range(MAX_CONVERSATIONS)), *NAMES, *(c for _, _, h in GROUPS for _, c in h), *user_turns(60)]
    )
