"""What shapes attention scores: rotary and ALiBi positions (DeepSeek-V4's tail rotary too), query scales and
temperatures, query, key and value norms, attention sinks and chunked masks."""
