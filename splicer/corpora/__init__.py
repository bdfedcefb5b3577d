"""Corpora, the scoring stage's input: named lists of token sequences declared in a plan (`core`), the chat template
they are rendered with (`chat`), and the demo's own tokenizer made from the shipped texts (`demo_tokenizer`).
"""
