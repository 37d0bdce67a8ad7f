"""What shapes attention scores: rotary and ALiBi positions, query scales and temperatures, query, key and value
norms."""
