// Placeholder until the gpu issue fills this module in.
