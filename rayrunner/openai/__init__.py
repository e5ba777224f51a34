"""OpenAI request and reply shaping, engine-neutral: the events an engine yields, the replies built from them,
sampling settings, chat prompts, tool calls, structured output and images."""
