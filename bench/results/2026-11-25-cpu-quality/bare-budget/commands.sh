cd /work/main
run() { name=$1; shift; /usr/bin/time -f "%e s wall" -o /tmp/runs/$name.time python train.py --output_dir /tmp/runs/$name --overwrite_output_dir "$@" > /tmp/runs/$name.log 2>&1;
  python sample.py /tmp/runs/$name --fid --num_images 256 --batch_size 64 > /tmp/runs/$name.fid 2>&1; }
run e2s_b8 --model edm2small --train_batch_size 8 --num_epochs 9
run bare
run e2s_b4 --model edm2small --train_batch_size 4 --num_epochs 7
run deep_b4 --model small_deep --train_batch_size 4 --num_epochs 7 --prediction_type v_prediction --timestep_sampling lognormal --no-use_ema
echo alldone > /tmp/runs/exp.done
run data8k --shapes_num_images 8192 --num_epochs 3   # scored again with --dataset shapes
