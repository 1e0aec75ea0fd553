// Placeholder until the nvme issue fills this module in.
