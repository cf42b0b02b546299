"""The HTTP server stack shifu's services share (the reward service, the policy gateway): strict request reading,
JSON errors, the bearer token, the queue that merges concurrent requests into one batched call, the runner."""
