"""The one reader of torch schemas: an op's cached record (op_record.py), where its tensors sit in a
call (args.py), its output meta on meta tensors (out_meta.py) and the ops that write arguments they
do not return (written_args.py)."""
