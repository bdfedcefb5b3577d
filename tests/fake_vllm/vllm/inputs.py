def TokensPrompt(prompt_token_ids):  # noqa: N802 - the real one is a TypedDict
    return {"prompt_token_ids": prompt_token_ids}
