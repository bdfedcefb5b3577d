"""The built-in synthetic chat set: a persona system prompt, a few turns of history and a generated user turn,
rendered with the model's chat template (thinking off).

The assistant answers are not stored here: the base generates them greedily, and the
variants are scored on those answers (dNLL), as in seed 000's harness. Everything is
written for this tool; nothing is taken from a data set.

Every conversation is its own context. Conversation i has its own assistant name (the system prompt's first word,
each starting with its own character), its own pair of business and history (business i % 8, history i // 8: no pair
repeats) and its own last user turn. Conversations that shared a system prompt and history shared their effect (a
variant that misreads that prefix misreads it in all of them), so a bootstrap over conversations took them for more
independent evidence than they were; and a shared prefix is the same context again, which scores.first_occurrence_weights
counts once. Beyond the chat template's own header (`<|im_start|>system` and a newline, the same for every
conversation) no two conversations share a token. They still share text: conversations of one business share its rules,
and those of one history (i // 8) its turns, and their effects still cluster somewhat (docs/ablate.md says how much);
conversations each with its own business and history would remove that.
"""

from __future__ import annotations

import itertools

# Names start with distinct characters: a byte-level tokenizer then starts every system prompt with its own token.
NAMES = [
    "Anna", "Bao", "Carmen", "Dmitri", "Elena", "Felix", "Grace", "Hiro", "Ines", "Jonas", "Kemal", "Lin", "Mei",
    "Nadia", "Oscar", "Priya", "Quinn", "Rosa", "Sami", "Tomas", "Uma", "Viktor", "Wen", "Ximena", "Yusuf", "Zora",
    "王芳", "李静", "张伟", "刘洋", "陈晨", "杨帆", "黄蕾", "赵磊", "吴敏", "周婷", "徐斌", "孙悦", "马骏", "朱琳",
    "胡杰", "郭蓉", "何平", "高远", "罗兰", "钟楠", "梁雪", "谢东", "宋雨", "唐宁", "韩梅", "冯涛", "邓佳", "曹阳",
    "彭程", "曾丽", "田野", "董飞", "袁媛", "潘峰", "蒋勇", "蔡琴", "于洋", "钱程", "叶青", "程亮", "苏珊", "魏来",
    "方舟", "丁香", "时雨", "车健",
]

# (who the assistant is, its house rules): one each per business.
BUSINESSES = [
    ("the voice assistant of a small travel company",
     "Speak Chinese and English, answer in one or two short spoken sentences, never use lists or markdown, and ask a short "
     "question back when the request is unclear. Keep prices in yuan and times in 24-hour format. 回答要口语化，一两句话说完。"),
    ("the booking desk of a mountain guesthouse",
     "Reply briefly and politely in the guest's language, confirm dates back, and never promise a room you have not "
     "checked. 用客人的语言简短回答，先确认日期。"),
    ("the phone assistant of a city museum",
     "Answer in at most two sentences, give opening hours and ticket prices exactly, and suggest one exhibit when asked "
     "what to see. 开放时间和票价要准确。"),
    ("the rental counter of a bicycle shop by the lake",
     "Quote hourly and daily prices, ask for a deposit of 200 yuan, and remind riders to bring the bike back before "
     "dusk. 自行车要在天黑前还回来。"),
    ("the receptionist of a dental clinic",
     "Book, move or cancel appointments, never give medical advice on the phone, and ask for the patient's name and "
     "phone number. 不在电话里给医疗建议。"),
    ("the information desk of a railway station",
     "Give departure times, platforms and fares from the timetable only, and say so when a train is delayed. "
     "只按时刻表回答，晚点要说明。"),
    ("the order line of a neighbourhood bakery",
     "Take cake orders at least one day ahead, repeat the order and the pick-up time back, and mention that "
     "nothing contains nuts unless asked for. 蛋糕要提前一天订。"),
    ("the ticket office of a river ferry company",
     "Sell tickets for the 08:00, 12:00 and 16:00 boats, say when a boat is full, and tell passengers to arrive fifteen "
     "minutes early. 请提前十五分钟到码头。"),
]

# Earlier turns any of the businesses could have had with a caller; every history has HISTORY_TURNS turns.
HISTORIES = [
    [("user", "你好，我想问一下周末的安排。"), ("assistant", "好的，您是周六还是周日来？"),
     ("user", "Saturday, around ten in the morning."), ("assistant", "Saturday at ten works; how many people will come?")],
    [("user", "Hi, is anyone there? I called earlier and the line dropped."), ("assistant", "Yes, I'm here, sorry about that. What were you asking?"),
     ("user", "我们是两个大人一个小孩。"), ("assistant", "两个大人一个小孩，小孩半价。")],
    [("user", "请问你们几点开门？"), ("assistant", "早上八点半开门，晚上六点关门。"),
     ("user", "And on public holidays?"), ("assistant", "On public holidays we open at ten and close at four.")],
    [("user", "Can I pay by card, or only cash?"), ("assistant", "Card, cash and mobile payment are all fine."),
     ("user", "那可以开发票吗？"), ("assistant", "可以，请把公司名称和税号发给我们。")],
    [("user", "我的名字是陈小红，上周订过一次。"), ("assistant", "陈女士您好，我查到了上周的订单。"),
     ("user", "Great, I'd like the same as last time."), ("assistant", "The same as last time, for which day?")],
    [("user", "How do I get to you from the old town?"), ("assistant", "Take bus 12 to the last stop; we are two minutes' walk from there."),
     ("user", "有停车的地方吗？"), ("assistant", "门口有十个车位，停车免费。")],
    [("user", "我想取消明天的预约。"), ("assistant", "好的，明天下午三点的那个，对吗？"),
     ("user", "Yes, and can I move it to Friday instead?"), ("assistant", "Friday at three is free, so I have moved it there.")],
    [("user", "Do you speak English? My Chinese is not very good."), ("assistant", "Yes, we can talk in English, no problem."),
     ("user", "Thanks. My grandmother uses a wheelchair."), ("assistant", "There is a ramp at the side entrance and a lift inside.")],
    [("user", "喂，你好，信号不太好。"), ("assistant", "您好，我听得到，请慢慢说。"),
     ("user", "We are a school group of thirty students."), ("assistant", "For groups of twenty or more there is a 20 % discount.")],
]
HISTORY_TURNS = 4
MAX_CONVERSATIONS = min(len(NAMES), len(BUSINESSES) * len(HISTORIES))

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
    if len(out) < n or n > MAX_CONVERSATIONS:
        raise ValueError(f"the built-in chat set has {min(len(out), MAX_CONVERSATIONS)} conversations; ask for at most that many")
    return out


def persona(i: int) -> str:
    """Conversation i's system prompt: its own name first, then business i % 8's role and rules."""
    role, rules = BUSINESSES[i % len(BUSINESSES)]
    return f"{NAMES[i]} here: you are {role}. {rules}"


def conversations(n: int, history_turns: int = HISTORY_TURNS) -> list[list[dict]]:
    """n conversations, each with its own name, (business, history) pair and last user turn (see the module docstring)."""
    out = []
    for i, u in enumerate(user_turns(n)):
        history = HISTORIES[i // len(BUSINESSES) % len(HISTORIES)][:history_turns]
        out.append([{"role": "system", "content": persona(i)}, *({"role": r, "content": c} for r, c in history),
                    {"role": "user", "content": u}])
    return out


def chat_training_text() -> str:
    return "\n".join([*(persona(i) for i in range(MAX_CONVERSATIONS)), *(c for h in HISTORIES for _, c in h), *user_turns(60)])
