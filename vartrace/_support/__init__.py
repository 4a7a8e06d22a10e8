"""Private helpers every layer may use: warnings, host memory, forks, interpreter exit, text,
progress bars.

Nothing here knows of models, records or files; nothing here is API.
"""
