// Placeholder until the cpu_adam issue fills this module in.
