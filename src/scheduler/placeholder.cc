// Placeholder until the scheduler issue fills this module in.
