"""How a lesson runs, reports and ends; imports no topic, no plot and no run tool."""
