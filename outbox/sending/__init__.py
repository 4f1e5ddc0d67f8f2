"""Sending outbound messages: `rules` (what may go, how an answer is recorded), `single`
(one message, its own task) and `batch` (a bot's drain). Both paths claim, write the attempt
and record the outcome through the same rules and transitions."""
